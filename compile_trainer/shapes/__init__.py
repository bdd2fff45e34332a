"""Variable-length batches at run time: padding and marking batches, and the region-call interceptors."""
