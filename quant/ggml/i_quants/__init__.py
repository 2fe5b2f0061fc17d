"""The i-quants: the lattice types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (`numpy_iq2`, `numpy_iq3`; in torch
`torch_iq` over the codebook search of `torch_grid`) and the non-linear IQ4_XS, IQ4_NL (`numpy_iq4`, `torch_iq4`)."""
