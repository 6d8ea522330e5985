"""Layer builders of the array family."""
