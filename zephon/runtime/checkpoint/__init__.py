"""The checkpoint: the state's fields, their checks, its files, and job states merged from ranks."""
