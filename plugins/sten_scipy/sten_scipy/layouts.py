"""The scipy layouts of this plugin and how they relate.

Example:
    >>> [cls.__name__ for cls in SCIPY_LAYOUTS]
    ['ScipyCsrTensor', 'ScipyCscTensor']
"""

from __future__ import annotations

from .csc import ScipyCscTensor
from .csr import ScipyCsrTensor

SCIPY_LAYOUTS = (ScipyCsrTensor, ScipyCscTensor)
TRANSPOSED = {ScipyCsrTensor: ScipyCscTensor, ScipyCscTensor: ScipyCsrTensor}
