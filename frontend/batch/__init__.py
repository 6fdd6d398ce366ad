"""Batch jobs in OpenAI's batch file format, offline (`pagedserve run-batch`) and online
(/v1/files and /v1/batches, frontend/http/batches_api.py), torch-free:

    runner.py      one line -> one result line, through the frontend's own HTTP app in-process;
                   a whole file of lines with bounded concurrency
    app_client.py  that app's in-process client, which can leave as a network client leaves
    files.py       the files of /v1/files, on disk under the data dir
    jobs.py        the batches of /v1/batches: their objects, and each run in the background

Nothing here imports frontend.http: the routes import this package, and the app a runner
sends lines to is handed to it.
"""
