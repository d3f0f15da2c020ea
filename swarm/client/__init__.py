"""The client: the model a user trains and its remote optimizer."""
