"""The OpenAI-compatible HTTP server (``lmserve serve``): FastAPI on uvicorn over an ``AsyncEngine``.

``app.create_app`` builds the application, ``run.serve`` runs it until SIGTERM has drained it.
"""
