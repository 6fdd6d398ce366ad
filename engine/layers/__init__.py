"""Model building blocks shared by every architecture in `engine/models/`."""
