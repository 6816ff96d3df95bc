"""C++ sources of the native CPU kernel and its build step (``python -m attnkit.csrc.build``)."""
