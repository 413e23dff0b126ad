"""A fused linear + cross-entropy loss (the LM head and its loss in one op) that never writes the logits;
`LinearCrossEntropy` / `NNXLinearCrossEntropy` are heads that return the loss.

    from pallas_fused.loss import linear_cross_entropy
    loss = linear_cross_entropy(hidden, lm_head_kernel, labels)   # hidden (..., d), kernel (d, vocab)
"""

from pallas_fused.loss.api import linear_cross_entropy
from pallas_fused.loss.flax import LinearCrossEntropy, NNXLinearCrossEntropy
from pallas_fused.loss.reference import reference_linear_cross_entropy

__all__ = ["LinearCrossEntropy", "NNXLinearCrossEntropy", "linear_cross_entropy", "reference_linear_cross_entropy"]
