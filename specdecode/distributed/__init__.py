"""Scale-out on Ray (the optional `ray` extra): engine replicas on Ray Serve behind one
OpenAI-compatible ingress with prefix-aware routing (`serve`), and batch generation over a Ray
Data dataset (`data`). Nothing here is imported unless asked for; without Ray installed the rest
of specdecode works as before."""
