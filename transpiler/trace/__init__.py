"""From a model, an optimizer and a loss to one traced step program (forward, backward and update)."""
