"""The keygroups command line."""
