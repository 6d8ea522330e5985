"""Layer builders of the vision family."""
