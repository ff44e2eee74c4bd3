"""An index in shards searched as one: each retriever fans a query out to every shard and merges,
scoring as the whole index would (:mod:`engine.shards.bm25`, :mod:`engine.shards.dense`)."""
