"""Images in, text out (issue 48, in progress): what the frontend does with an image before
the engine sees it. So far, preprocessing by the model's own transformers image processor
without torch (`image_processors`); the API parts, fetching, the IPC and the engine's
encoder come next (docs/engine.md says which families run)."""
