import java.io.Serializable;
import java.util.Collections;
import java.util.concurrent.TimeoutException;

import org.apache.spark.api.java.function.MapFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.streaming.OutputMode;
import org.apache.spark.sql.streaming.StatefulProcessor;
import org.apache.spark.sql.streaming.StreamingQuery;
import org.apache.spark.sql.streaming.TTLConfig;
import org.apache.spark.sql.streaming.TimeMode;
import org.apache.spark.sql.streaming.TimerValues;
import org.apache.spark.sql.streaming.Trigger;
import org.apache.spark.sql.streaming.ValueState;

import scala.collection.Iterator;
import scala.jdk.javaapi.CollectionConverters;

/**
 * The state Spark's offline repartition is measured on (benchmarks/bench_rescale_scale.py --spark-repartition),
 * built in the JVM: transformWithStateInPandas spends Python time per key, 18 minutes for 1M keys.
 *
 * Per key one ValueState "countSum" holding a struct (count long, sum long), the same state variable, name and value
 * schema as spark_tws_baseline.RunningCountSum, so Spark's state data source reads both the same way. The query:
 * Parquet file source ("key long, value long") -> groupByKey(key) -> transformWithState (TimeMode.None, no output
 * rows) -> noop sink, trigger AvailableNow. The session's conf chooses the state store provider (it must be RocksDB
 * for transformWithState) and the number of state partitions (spark.sql.shuffle.partitions).
 */
public class RepartitionStateTws {
    /** The ValueState's value; a bean, so that its encoder is the struct (count long, sum long). */
    public static class CountSum implements Serializable {
        private long count;
        private long sum;

        public CountSum() {
        }

        public long getCount() {
            return count;
        }

        public void setCount(long count) {
            this.count = count;
        }

        public long getSum() {
            return sum;
        }

        public void setSum(long sum) {
            this.sum = sum;
        }
    }

    public static class Accumulate extends StatefulProcessor<Long, Row, Long> {
        private transient ValueState<CountSum> state;

        @Override
        public void init(OutputMode outputMode, TimeMode timeMode) {
            state = getHandle().getValueState("countSum", Encoders.bean(CountSum.class), TTLConfig.NONE());
        }

        @Override
        public Iterator<Long> handleInputRows(Long key, Iterator<Row> rows, TimerValues timerValues) {
            CountSum current = state.get();   // null for a key without state
            if (current == null) {
                current = new CountSum();
            }
            while (rows.hasNext()) {
                current.setCount(current.getCount() + 1);
                current.setSum(current.getSum() + rows.next().getLong(1));
            }
            state.update(current);
            return CollectionConverters.asScala(Collections.<Long>emptyIterator());
        }
    }

    public static StreamingQuery start(SparkSession spark, String source, String checkpoint, int maxFilesPerTrigger)
            throws TimeoutException {
        Dataset<Row> events = spark.readStream().schema("key long, value long")
                .option("maxFilesPerTrigger", maxFilesPerTrigger).parquet(source);
        Dataset<Long> none = events
                .groupByKey((MapFunction<Row, Long>) r -> r.getLong(0), Encoders.LONG())
                .transformWithState(new Accumulate(), TimeMode.None(), OutputMode.Append(), Encoders.LONG());
        return none.writeStream()
                .format("noop")
                .option("checkpointLocation", checkpoint)
                .outputMode("append")
                .trigger(Trigger.AvailableNow())
                .start();
    }
}
