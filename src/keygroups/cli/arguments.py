"""Argument types of the ``keygroups`` command: a bad value is a usage error that names it and what is allowed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give a whole number >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}; give a whole number <= {maximum}")
        return value

    return parse


def storage_option(text: str) -> tuple[str, Any]:
    """An argparse type: one fsspec storage option, ``key=value`` (the value is a string) or ``key:=JSON`` (the
    value is JSON: ``anon:=true``, ``client_kwargs:={"region_name": "eu-west-1"}``)."""
    name, sep, value = text.partition("=")
    if not sep or not name or name == ":":
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE or KEY:=JSON, e.g. "
                                         "endpoint_url=http://127.0.0.1:8333")
    if not name.endswith(":"):
        return name, value
    try:
        return name[:-1], json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"the value of {name[:-1]!r} (after :=) is not JSON ({e}); write "
                                         f"{name[:-1]}=... for a string") from None


class _StorageOptions(argparse.Action):
    """Collects ``--storage-option`` pairs into one dict; a key given twice is a usage error naming the key (never
    its values: they may be secrets)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        key, value = values
        options = dict(getattr(namespace, self.dest) or {})
        if key in options:
            raise argparse.ArgumentError(self, f"{key} is given twice; give each option once")
        options[key] = value
        setattr(namespace, self.dest, options)


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): options for the fsspec filesystem of a checkpoint URL, in
    ``args.storage_options`` (a dict, empty by default)."""
    parser.add_argument(
        "--storage-option", dest="storage_options", type=storage_option, action=_StorageOptions, default={},
        metavar="KEY=VALUE",
        help="an option of the checkpoint URL's fsspec filesystem, e.g. endpoint_url=http://127.0.0.1:8333 or "
             "anon:=true (KEY:=JSON); repeatable. s3:// also reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
             "AWS_ENDPOINT_URL from the environment, in every process")
