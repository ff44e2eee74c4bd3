"""What an index directory holds and how it changes live: the document store, the write-ahead log,
the one writer and its followers."""
