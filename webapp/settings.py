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
- ``DATABASE_POOL_MAX``/``_MIN``/``_TIMEOUT``/``_MAX_IDLE``: PostgreSQL connection pool
  (``webapp.config.database_pool_from_env``).
- ``LOGIN_FAILURE_LIMIT``/``LOGIN_LOCKOUT`` and ``API_TOKEN_FAILURE_LIMIT``/``API_TOKEN_LOCKOUT``:
  throttling of failed sign-ins and failed API token checks (below).
- ``TRIBUTARY_HTTPS`` and its overrides, ``CSP_MODE``: headers and cookies for TLS (below).
- ``TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE`` (default false): alert webhooks may call private and
  loopback addresses (a receiver inside the team's network; ``webapp.alerts.webhooks``).
"""

from __future__ import annotations

from pathlib import Path

from csp.constants import NONE, SELF
from django.core.exceptions import ImproperlyConfigured

from webapp.config import (
    data_dir,
    database_from_url,
    database_pool_from_env,
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
    "axes",
    "csp",
    "webapp.teams",
    "webapp.runs",
    "webapp.alerts",
    "webapp.analysis",
    "webapp.api",
    "webapp.pages",
    "webapp.embedded",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    # Static files (ours and the npm packages') from the web process itself: no CDN, no
    # separate file server in embedded mode.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "webapp.middleware.RejectUnstorableInput",  # 400 for NUL/undecodable text (before anything reads it)
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # A 503, not a 500, for a page that found the database connection pool exhausted.
    "webapp.dbpool.PoolExhaustedMiddleware",
    # Last, as django-axes asks: turns a locked-out sign-in into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "webapp.urls"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
# A refused form renders inside the site's layout (the error handlers are in webapp/urls.py).
CSRF_FAILURE_VIEW = "webapp.pages.errors.csrf_failure"
WSGI_APPLICATION = "webapp.wsgi.application"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # Templates sit beside the code that renders them: the pages app's own templates/
        # (APP_DIRS) and one templates/ per page package (launch, rollouts, runs, teams).
        "DIRS": sorted((BASE_DIR / "webapp" / "pages").glob("*/templates")),
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "webapp.context_processors.contracts",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL"), DATA_DIR, pool=database_pool_from_env())}
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
# The cache holds the throttling counters (failed sign-ins, failed API token checks): on Redis
# every web replica sees the same counts; without Redis (embedded mode: one web process) the
# process's memory is enough.
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "tributary",
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    # axes.W001 says a per-process cache cannot share counts between processes: in embedded mode
    # one web process serves everything, so there is nothing to share.
    SILENCED_SYSTEM_CHECKS = ["axes.W001"]

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
# The web app's copy of each run's engine output stops growing here (webapp.runs.output): a chatty
# run cannot fill the web machine's disk; the worker's engine.log keeps everything.
FULL_LOG_MAX_BYTES = env_int("FULL_LOG_MAX_MB", 1024, minimum=1) * 1024 * 1024

# --- Throttling ----------------------------------------------------------------------------
# Sign-in (the login form, the admin's, any authenticate() with a request): django-axes counts
# failures per account and per client address in the cache above; at LOGIN_FAILURE_LIMIT
# failures of either, sign-ins for that account, or from that address, are refused (even with
# the right password, and without hashing it) for LOGIN_LOCKOUT seconds after the last failure,
# with a 429 page that says how long to wait (webapp.pages.signin). A successful sign-in clears
# the account's and the address's counts. LOGIN_FAILURE_LIMIT=0 turns it off.
LOGIN_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, minimum=0)
LOGIN_LOCKOUT = env_int("LOGIN_LOCKOUT", 15 * 60, minimum=1)
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out sign-in before the hash
    "django.contrib.auth.backends.ModelBackend",
]
AXES_ENABLED = LOGIN_FAILURE_LIMIT > 0
AXES_FAILURE_LIMIT = max(LOGIN_FAILURE_LIMIT, 1)
AXES_COOLOFF_TIME = "webapp.pages.signin.cool_off"  # LOGIN_LOCKOUT
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]  # either one reaching the limit locks
AXES_HANDLER = "axes.handlers.cache.AxesCacheHandler"
AXES_RESET_ON_SUCCESS = True
# Attempts while locked out do not push the end of the lockout back: the wait the page names holds.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
# The address is the ASGI server's (uvicorn --proxy-headers trusts X-Forwarded-For only from
# FORWARDED_ALLOW_IPS), never a header the client could set.
AXES_CLIENT_IP_CALLABLE = "webapp.pages.signin.client_address"
AXES_LOCKOUT_CALLABLE = "webapp.pages.signin.lockout_response"
AXES_VERBOSE = False
# API tokens (webapp.api.auth.FailedTokenChecks): failed checks per address; at the limit every
# token check from it is a 429 until API_TOKEN_LOCKOUT seconds after its first failure. Only
# failures count: a client with a valid token is never throttled. 0 turns it off.
API_TOKEN_FAILURE_LIMIT = env_int("API_TOKEN_FAILURE_LIMIT", 50, minimum=0)
API_TOKEN_LOCKOUT = env_int("API_TOKEN_LOCKOUT", 15 * 60, minimum=1)

TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE = env_bool("TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE", default=False)

# --- Headers and cookies for TLS deployments -------------------------------------------------
# TRIBUTARY_HTTPS=1 (the site is served over https, usually by a proxy in front): secure session
# and CSRF cookies, HSTS, and the proxy's X-Forwarded-Proto trusted for "is this https". Each
# can be overridden. Unset, embedded mode at http://127.0.0.1 works as before.
HTTPS = env_bool("TRIBUTARY_HTTPS", default=False)


def _override(name: str, default: bool) -> bool:
    """A blank value (compose passes ``${VAR:-}``) leaves the default, as if unset."""
    return env_bool(name, default) if env_str(name) else default


SESSION_COOKIE_SECURE = _override("SESSION_COOKIE_SECURE", HTTPS)
CSRF_COOKIE_SECURE = _override("CSRF_COOKIE_SECURE", HTTPS)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _override("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = _override("SECURE_HSTS_PRELOAD", False)
# Off by default even with HTTPS: the proxy redirects http, and health checks reach the web
# process over plain http inside the deployment.
SECURE_SSL_REDIRECT = _override("SECURE_SSL_REDIRECT", False)
_proxy_ssl_header = env_str("SECURE_PROXY_SSL_HEADER") or ("X-Forwarded-Proto" if HTTPS else "")
if _proxy_ssl_header.lower() in {"", "off", "none", "0", "false"}:
    SECURE_PROXY_SSL_HEADER = None
elif not all(c.isalnum() or c == "-" for c in _proxy_ssl_header):
    raise ImproperlyConfigured(
        f"SECURE_PROXY_SSL_HEADER={_proxy_ssl_header!r} is not a header name: use e.g. X-Forwarded-Proto "
        "(the header your proxy sets to 'https'), or 'off'"
    )
else:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https")

# Content-Security-Policy (django-csp), in every mode: the pages load scripts, styles and data
# only from this origin (no inline script or style, no eval), sockets to it, frames from nowhere.
# CSP_MODE: enforce (default), report-only (browsers only report violations), off.
CSP_MODE = env_str("CSP_MODE", "enforce").lower()
_CSP_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],
        "font-src": [SELF],
        "connect-src": [SELF],  # CSP level 3: 'self' covers ws:/wss: to the same host
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    }
}
if CSP_MODE == "enforce":
    CONTENT_SECURITY_POLICY = _CSP_POLICY
elif CSP_MODE == "report-only":
    CONTENT_SECURITY_POLICY_REPORT_ONLY = _CSP_POLICY
elif CSP_MODE == "off":
    MIDDLEWARE.remove("csp.middleware.CSPMiddleware")
else:
    raise ImproperlyConfigured(f"CSP_MODE={CSP_MODE!r} is not one of enforce, report-only, off")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO").upper()},
}
