"""Documents that change while the index serves: the one writer (write-ahead log, refresh,
checkpoint) and the read-only followers that show its writes."""
