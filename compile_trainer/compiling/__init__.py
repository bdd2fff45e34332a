"""Compiling a plan: regions compiled in place, the interceptor chain of their calls, backends, background
compilation on a thread, gradients under CUDA graphs, and the plan table."""
