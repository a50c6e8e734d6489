"""The engine: sequences, the scheduler that batches them, and the loop both the library and the server drive."""
