"""Render the CloudFormation templates (`cfn/`) and boot scripts (`worker_image/`) with jinja2.

Templates are rendered completely in Python (AZs, CIDRs, ARNs of known names, user data), so what is sent
to CloudFormation is exactly what the tests, cfn-lint and checkov read.
"""

from __future__ import annotations

import json
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any

from petctl.core.errors import ProviderError

CFN_DIR = "cfn"
BOOT_DIR = "worker_image"


def resource_dir(name: str) -> Path:
    """`cfn/` or `worker_image/`: the top-level directory in a checkout (or an editable install), else the
    copy packaged inside petctl (`petctl/_templates/<name>`, see setup.py). Raises ProviderError when
    neither holds templates (a broken install)."""
    package = Path(__file__).resolve().parents[2]
    candidates = [package.parent / name, package / "_templates" / name]
    for path in candidates:
        if any(path.glob("*.j2")):
            return path
    looked = ", ".join(map(str, candidates))
    raise ProviderError(f"petctl's {name}/ templates are missing (looked in {looked})")


def _json_string(value: Any) -> str:
    """JSON is valid YAML flow syntax, so any value (multi-line user data included) embeds safely."""
    return json.dumps(value, ensure_ascii=False)


@lru_cache(maxsize=4)
def _environment(directory: str):
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["tojson"] = _json_string
    env.filters["shellquote"] = lambda value: shlex.quote(str(value))
    return env


def render(directory: str, template: str, **context: Any) -> str:
    return _environment(str(resource_dir(directory))).get_template(template).render(**context)


def render_base(**context: Any) -> str:
    """The base stack's template. The IAM scope of its job stacks (jobscope.py) is added here, so the
    service role's scope and the job roles' paths come from one place."""
    from petctl.providers.aws.jobscope import base_scope

    return strip_comments(render(CFN_DIR, "base.yaml.j2", **base_scope(context["stack_name"]), **context))


def render_seed(**context: Any) -> str:
    """The base stack's first template: its bucket alone (cfn/seed.yaml.j2), small enough for a
    TemplateBody. `setup` creates a new stack from it, then updates the stack from the full template in
    that bucket (a TemplateURL must name an object that already exists)."""
    return strip_comments(render(CFN_DIR, "seed.yaml.j2", **context))


# CloudFormation's limits (CreateStack/UpdateStack API reference, "TemplateBody" and "TemplateURL"): 51,200
# bytes sent inline; 1 MB fetched from S3, by a URL of at most 1,024 characters that starts with https://.
# petctl sends every full template by URL (stacks.publish); only the seed goes inline.
TEMPLATE_BODY_LIMIT = 51_200
TEMPLATE_URL_LIMIT = 1024 * 1024
TEMPLATE_URL_MAX_CHARS = 1024


def strip_comments(template: str) -> str:
    """A rendered template without its whole-line YAML comments: they explain the source (cfn/), and
    CloudFormation counts every byte of a TemplateBody. The templates hold no block scalars, and every
    multi-line string (user data) is one JSON line, so a line that starts with # is always a comment."""
    return "".join(line for line in template.splitlines(keepends=True) if not line.lstrip().startswith("#"))


def render_job(**context: Any) -> str:
    return render(CFN_DIR, "job.yaml.j2", **context)


def render_boot(template: str, **context: Any) -> str:
    return render(BOOT_DIR, template, **context)


_HEREDOC_RE = re.compile(r"(?<!<)<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def compact_shell(script: str) -> str:
    """A boot script without its comment lines, blank lines and indentation, for EC2's 16 KB user data
    (the templates keep their comments; the instance runs the same commands). Heredoc bodies (the agent
    config, systemd units, helper scripts) and the shebang are kept exactly; a line continued with a
    backslash right after a word keeps the next line's indentation, which then separates two words."""
    out: list[str] = []
    end: str | None = None  # the heredoc we are in
    for i, line in enumerate(script.splitlines()):
        if end is not None:
            out.append(line)
            end = None if line.strip() == end else end
            continue
        stripped = line.strip()
        if i and (not stripped or stripped.startswith("#")):
            continue
        glued = bool(out) and out[-1].endswith("\\") and not out[-1][-2:-1].isspace()
        out.append(line if i == 0 or glued else stripped)
        match = _HEREDOC_RE.search(line)
        if match:
            end = match.group(2)
    return "\n".join(out) + "\n"
