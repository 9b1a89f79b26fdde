"""The streaming runtime layer: the agents' SDK (`sdk`) and the Faust worker that runs processors (`runtime`)."""
