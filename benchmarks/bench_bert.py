"""The paper's Fig. 2: forward time of a BERT-base encoder layer per layout and
sparsity. A thin wrapper around ``sten bench`` (same options):

    python benchmarks/bench_bert.py --quick
    python benchmarks/bench_bert.py --layouts dense,torch_csr,nm --threads 1,2 --out bench-out
"""

import sys

from sten_core.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
