"""Pictures of the pool and of runs: SVG drawings, matplotlib plots and the widgets that animate a trace."""
