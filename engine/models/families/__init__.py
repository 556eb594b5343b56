"""One module per model family; ``pdserve.engine.models.registry`` says which runs which architecture."""
