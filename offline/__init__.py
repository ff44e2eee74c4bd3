"""What only offline work uses: BEIR datasets, evaluation, latency runs, result records, progress."""
