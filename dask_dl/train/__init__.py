"""The training room: gradient compression, training actors, the fit driver and cross-site training."""
