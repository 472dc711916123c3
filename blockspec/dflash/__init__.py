"""The DFlash algorithm: the drafter, its checkpoint format, verification, sampling, lookup, the batch step and the block-size policy."""
