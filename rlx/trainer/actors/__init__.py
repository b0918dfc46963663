"""The Ray side: the actors, the controller's view of them, where they are placed."""
