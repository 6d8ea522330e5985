"""Layer builders of the normalization family."""
