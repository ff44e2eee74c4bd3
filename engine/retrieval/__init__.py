"""First-stage retrieval: Lucene BM25, the dense encoder and FAISS, and the judgment memory."""
