"""The optional CPU speed backend: C kernels (csrc/), their build, packed weights and the layer program (BLOCKSPEC_CPU_KERNELS=0 turns it off)."""
