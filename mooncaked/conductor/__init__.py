"""The conductor's pieces: instance registry, global prefix index, routing."""
