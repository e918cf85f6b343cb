"""The JSON API under ``/api/`` (django-ninja): session auth for the browser, personal API
tokens for scripts, and every object reached through ``webapp.teams.access``."""
