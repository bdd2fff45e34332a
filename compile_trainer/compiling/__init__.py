"""Compiling a plan: regions compiled in place, the interceptor chain of their calls, backends, background
compilation on a thread, and gradients under CUDA graphs."""
