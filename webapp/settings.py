"""Django settings, read from environment variables (see ``webapp/config.py``).

- ``TRIBUTARY_DATA_DIR``: data directory (SQLite database, generated secret key).
- ``DATABASE_URL``: ``postgres://...`` switches from SQLite to PostgreSQL (psycopg 3).
- ``SECRET_KEY``: else generated once into the data directory (mode 0600).
- ``DEBUG`` (default false), ``ALLOWED_HOSTS`` (comma-separated; default localhost only).
- ``REDIS_URL``: the Channels layer on Redis (and the Celery broker, see ``jobs/app.py``);
  unset, an in-memory layer (embedded mode: one web process).
- ``INGEST_TOKEN_MAX_AGE`` (s, default 1 day, renewed over the socket), ``LOST_AFTER`` (s
  without hearing from a run's worker before it is lost, default 120), ``CANCEL_GRACE`` (s
  between SIGTERM and SIGKILL, read by the worker).
"""

from __future__ import annotations

from pathlib import Path

from webapp.config import (
    data_dir,
    database_from_url,
    env_bool,
    env_int,
    env_list,
    env_str,
    secret_key_from,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = data_dir()

SECRET_KEY = secret_key_from(DATA_DIR, env_str("SECRET_KEY"))
DEBUG = env_bool("DEBUG", default=False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "webapp.teams",
    "webapp.runs",
    "webapp.api",
    "webapp.pages",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (ours and the npm packages') from the web process itself: no CDN, no
    # separate file server in embedded mode.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
WSGI_APPLICATION = "webapp.wsgi.application"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL"), DATA_DIR)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATA_DIR.mkdir(parents=True, exist_ok=True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# collectstatic's target, for an image that serves compressed copies (whitenoise serves it too).
STATIC_ROOT = env_str("STATIC_ROOT") or None
# Front-end libraries come from the npm registry at install time (package.json, `make install`)
# and are served from node_modules under /static/vendor/.
STATICFILES_DIRS = [
    ("vendor/uplot", BASE_DIR / "node_modules" / "uplot" / "dist"),
    ("vendor/htmx", BASE_DIR / "node_modules" / "htmx.org" / "dist"),
]
# Served straight from the finders, so embedded mode needs no collectstatic step; a deployment
# image may run collectstatic and turn this off for compressed, cached files.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    # The pub/sub layer: ~1-1.7 ms per message here against ~2.5-3 ms for the list-based one.
    # Both drop messages for a consumer that falls behind; the run consumer catches up from
    # the database when it sees a gap in seq.
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 1000}}}

INGEST_TOKEN_MAX_AGE = env_int("INGEST_TOKEN_MAX_AGE", 24 * 3600, minimum=60)
LOST_AFTER = env_int("LOST_AFTER", 120, minimum=5)
SWEEP_EVERY = env_int("SWEEP_EVERY", 15, minimum=1)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO").upper()},
}
