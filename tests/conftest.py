"""Settings for the whole test session.

pytest-xdist workers (``make test`` runs the suite in ``TEST_WORKERS`` of them) share the
machine's cores: each runs torch on one thread, so two workers do not oversubscribe a 2-core
machine with four (the plugins' OpInfo pass took 215 s in a worker at torch's default threads,
91 s alone).
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
