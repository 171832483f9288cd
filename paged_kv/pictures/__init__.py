"""Pictures of the pool and of runs (lessons 00 to 09): SVG drawings, matplotlib plots and widgets."""
