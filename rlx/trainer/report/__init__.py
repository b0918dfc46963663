"""What a run shows: metrics, plots, the console, progress bars, the run record."""
