"""Long Range Arena: sequence models and token mixers as the PolaFormer paper ran them."""
