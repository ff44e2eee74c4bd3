"""The GPU kit: the GPU figures from an air-gapped GPU machine that starts bare, in as few commands as
its limits allow.

``pack`` (here, on a CPU) writes ``.gpukit/``: what the GPU image lacks (cp312 wheels, Lucene and
Anserini's analyzer cut from the Anserini jar, a Java 21 runtime), the NFCorpus index built here and
its dataset, as parts that each fit one transfer, and a manifest of their checksums. ``run`` (there)
takes the parts carried with each command, installs once into /tmp when all have arrived, then runs
the stages asked for and writes their results. ``plan`` prints the commands with the expected
minutes. docs/gpu.md is the walk-through.
"""
