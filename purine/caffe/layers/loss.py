"""Layer builders of the loss family."""
