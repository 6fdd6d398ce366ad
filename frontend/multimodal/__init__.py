"""Images in, text out (issue 48, in progress): what the frontend does with an image before
the engine sees it. So far: decoding what the APIs send, within limits (`images`), and
preprocessing by the model's own transformers image processor without torch
(`image_processors`). The API parts, fetching URLs, the IPC and the engine's encoder come
next; nothing here is wired to a request yet."""
