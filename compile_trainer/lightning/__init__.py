"""The Lightning integration: ``CompileCallback`` wires the library's parts to a Trainer's hooks."""
