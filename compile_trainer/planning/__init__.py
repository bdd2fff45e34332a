"""Planning: which submodules a policy's rules select, resolved into compiled regions and eager modules,
without compiling anything."""
