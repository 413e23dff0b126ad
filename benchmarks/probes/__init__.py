"""One-off measurements that a documented number rests on; each module's first line says which."""
