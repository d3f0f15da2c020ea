"""The peer daemon and what it serves."""
