"""The `vgpu` command: it parses arguments and calls the composition root."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from vgpu import __version__
from vgpu.core.errors import ConfigError

SERVE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--backend", {"choices": ["nvml", "mock"], "help": "nvml (real GPUs, default) or mock"}),
    ("--mock-gpus", {"metavar": "FILE", "help": "mock cards: a JSON/YAML file or preset:2xH200"}),
    ("--device-plugin-dir", {"metavar": "DIR", "help": "default /var/lib/kubelet/device-plugins"}),
    ("--pod-resources-socket", {"metavar": "PATH", "help": "the kubelet's pod-resources socket"}),
    ("--kubeconfig", {"metavar": "FILE", "help": "kubeconfig; default in-cluster or none"}),
    ("--node-name", {"metavar": "NAME", "help": "this node (default: $NODE_NAME)"}),
    ("--state-dir", {"metavar": "DIR", "help": "placements and configs (default /var/lib/vgpu)"}),
    ("--resource-domain", {"metavar": "D", "help": "resource domain (default vendor.io)"}),
    ("--memory-unit-mib", {"metavar": "N", "help": "MiB per vcuda-memory unit (default 256)"}),
    ("--policy", {"choices": ["binpack", "spread"], "help": "card choice (default binpack)"}),
    ("--ignored-xids", {"metavar": "LIST", "help": "comma-separated XIDs that are ignored"}),
    ("--metrics-address", {"metavar": "HOST:PORT", "help": "serve /metrics and /healthz"}),
    (
        "--metrics-container-names",
        {"choices": ["true", "false"], "help": "tenant names in metrics (default false)"},
    ),
    ("--log-format", {"choices": ["text", "json"], "help": "log format (default text)"}),
    ("--log-level", {"choices": ["debug", "info", "warning", "error"]}),
    ("--hook-library", {"metavar": "FILE", "help": "libvgpu.so to install and preload"}),
    ("--hook-dir", {"metavar": "DIR", "help": "host dir for the hook (default /usr/local/vgpu)"}),
    ("--api-wait-s", {"metavar": "S", "help": "longest wait for pod info at admission"}),
    ("--reconcile-interval-s", {"metavar": "S", "help": "re-check period (default 10)"}),
    ("--mode", {"choices": ["device-plugin", "dra"], "help": "default device-plugin"}),
    (
        "--kubelet-registry-dir",
        {"metavar": "DIR", "help": "dra: default /var/lib/kubelet/plugins_registry"},
    ),
    (
        "--kubelet-plugin-dir",
        {"metavar": "DIR", "help": "dra: default /var/lib/kubelet/plugins/vgpu.<domain>"},
    ),
    ("--cdi-dir", {"metavar": "DIR", "help": "dra: CDI spec directory (default /var/run/cdi)"}),
    ("--context-overhead-mib", {"metavar": "N", "help": "per-card context estimate (default 0)"}),
    (
        "--hook-injection",
        {"choices": ["ld-so-preload", "env"], "help": "hook loading (default ld-so-preload)"},
    ),
    (
        "--device-list-strategy",
        {"choices": ["envvar", "cdi", "volume-mounts"], "help": "card hand-over (default envvar)"},
    ),
    ("--host-dev-dir", {"metavar": "DIR", "help": "the host's /dev as seen here (default /dev)"}),
    ("--unallocated-policy", {"choices": ["warn", "evict"], "help": "unallocated containers"}),
]


EXTENDER_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--listen", {"metavar": "HOST:PORT", "help": "HTTP endpoint (default 127.0.0.1:8888)"}),
    ("--kubeconfig", {"metavar": "FILE", "help": "kubeconfig; default in-cluster"}),
    ("--resource-domain", {"metavar": "D", "help": "resource domain (default vendor.io)"}),
    ("--policy", {"choices": ["binpack", "spread"], "help": "node choice (default binpack)"}),
    ("--metrics-address", {"metavar": "HOST:PORT", "help": "serve /metrics and /healthz"}),
    ("--log-format", {"choices": ["text", "json"], "help": "log format (default text)"}),
    ("--log-level", {"choices": ["debug", "info", "warning", "error"]}),
    ("--bind-timeout-s", {"metavar": "S", "help": "API call timeout at bind (default 5)"}),
    (
        "--node-choice",
        {"choices": ["extender", "scheduler"], "help": "who picks the node (default extender)"},
    ),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu", description="Fractional NVIDIA GPU slices for Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"vgpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the device plugin daemon")
    serve.add_argument("--config", metavar="FILE", type=Path, help="YAML config file (version: v1)")
    for flag, kwargs in SERVE_FLAGS:
        serve.add_argument(flag, default=None, **kwargs)

    extender = sub.add_parser(
        "extender", help="serve kube-scheduler's HTTP extender protocol (per-card fit)"
    )
    extender.add_argument(
        "--config", metavar="FILE", type=Path, help="YAML config file (version: v1)"
    )
    for flag, kwargs in EXTENDER_FLAGS:
        extender.add_argument(flag, default=None, **kwargs)

    _webhook_parser(sub)

    demo = sub.add_parser("demo", help="mock GPUs against the built-in kubelet simulator")
    demo.add_argument("--gpus", default="preset:2xH200", help="mock cards (default preset:2xH200)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")
    demo.add_argument(
        "--dra", action="store_true", help="DRA mode: claims fitted by a scheduler stand-in"
    )
    demo.add_argument(
        "--cluster",
        action="store_true",
        help="three mock nodes, the scheduler extender and a scheduler stand-in",
    )

    status = sub.add_parser("status", help="show cards, slices and containers on this node")
    status.add_argument("--state-dir", type=Path, default=None, help="default /var/lib/vgpu")
    status.add_argument("-o", "--output", choices=["table", "json", "wide"], default="table")
    status.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    status.add_argument(
        "--cluster",
        action="store_true",
        help="every vgpu node and card of the cluster, from the API server's annotations",
    )
    status.add_argument("--kubeconfig", type=Path, default=None, help="with --cluster")
    status.add_argument(
        "--resource-domain", default="vendor.io", help="with --cluster (default vendor.io)"
    )

    config = sub.add_parser("config", help="check or print a config file")
    csub = config.add_subparsers(dest="config_command", required=True)
    check = csub.add_parser("check", help="validate a config file without starting")
    check.add_argument("file", type=Path)
    csub.add_parser("default", help="print a commented default config file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "extender":
            return _extender(args)
        if args.command == "webhook":
            return _webhook(args)
        if args.command == "demo":
            if args.dra:
                from vgpu.cli.drademo import run_dra_demo

                return run_dra_demo(args.gpus, keep=args.keep)
            if args.cluster:
                from vgpu.cli.demo_cluster import run_cluster_demo

                return run_cluster_demo(keep=args.keep)
            from vgpu.cli.demo import run_demo

            return run_demo(args.gpus, keep=args.keep)
        if args.command == "status" and args.cluster:
            from vgpu.cli.status_cluster import run_cluster_status

            return run_cluster_status(
                args.kubeconfig, args.output, args.color, args.resource_domain
            )
        if args.command == "status":
            from vgpu.cli.status import run_status

            return run_status(args.state_dir, args.output, args.color)
        if args.command == "config":
            from vgpu import config

            if args.config_command == "default":
                sys.stdout.write(config.default_file())
                return 0
            config.load({}, {}, args.file)
            print(f"{args.file}: ok")
            return 0
    except ConfigError as exc:
        print(f"vgpu: {exc.message}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover - argparse requires a command


def _flags(args: argparse.Namespace, spec: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in spec
    }


def _exit(code: int) -> int:
    # The orderly shutdown is done (sockets removed, servers stopped, state on
    # disk). Skip interpreter finalisation: background threads may still sit
    # inside gRPC or urllib3 C code, and tearing modules down under them can
    # abort the process (seen as SIGABRT after "stopped") and turn a clean
    # stop into a crash report.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    from vgpu import config
    from vgpu.daemon import logs, wiring

    settings = config.load(_flags(args, SERVE_FLAGS), config_file=args.config)
    logs.configure(settings.log_format, settings.log_level)
    if settings.mode == "dra":
        from vgpu.daemon.dra import run_dra

        return _exit(run_dra(settings))
    return _exit(wiring.run(settings))


def _extender(args: argparse.Namespace) -> int:
    from vgpu import config
    from vgpu.daemon import extender, logs

    settings = config.load_extender(_flags(args, EXTENDER_FLAGS), config_file=args.config)
    logs.configure(settings.log_format, settings.log_level)
    return _exit(extender.run(settings))


def _webhook_parser(sub: Any) -> None:
    p = sub.add_parser(
        "webhook", help="admission webhook: vgpu pods get the vgpu scheduler, bad requests refused"
    )
    p.add_argument("--config", metavar="FILE", type=Path, help="YAML config file (version: v1)")
    p.add_argument(
        "--listen", default="0.0.0.0:8443", metavar="HOST:PORT", help="HTTPS (default :8443)"
    )
    p.add_argument("--kubeconfig", type=Path, default=None, help="default: in-cluster")
    p.add_argument(
        "--cert-dir",
        type=Path,
        default=Path("/var/run/vgpu-webhook/certs"),
        help="ca.crt, tls.crt and tls.key: written here (--secret), else read from here",
    )
    p.add_argument(
        "--tls-san",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="extra DNS name or IP in the serving certificate (repeatable)",
    )
    p.add_argument(
        "--secret",
        default="",
        metavar="NAMESPACE/NAME",
        help="self-managed certificate kept in this Secret; unset: --cert-dir is mounted "
        "(cert-manager) and only read",
    )
    p.add_argument("--service", default="", metavar="NAMESPACE/NAME", help="the Service to certify")
    p.add_argument(
        "--mutating-config",
        default="",
        metavar="NAME",
        help="MutatingWebhookConfiguration: caBundle patched, owner of the Secret",
    )
    p.add_argument(
        "--validating-config",
        default="",
        metavar="NAME",
        help="ValidatingWebhookConfiguration: caBundle patched",
    )
    p.add_argument(
        "--scheduler-name",
        default="vgpu-scheduler",
        metavar="NAME",
        help="set on vgpu pods left to the default scheduler; empty: no mutation",
    )
    p.add_argument("--resource-domain", default=None, help="default: from --config, vendor.io")
    p.add_argument(
        "--cert-validity-s",
        type=float,
        default=365 * 86400.0,
        metavar="S",
        help="self-made serving certificate's validity (renewed at 2/3); default 1 year",
    )
    p.add_argument(
        "--cert-check-interval-s",
        type=float,
        default=10.0,
        metavar="S",
        help="how often the Secret or the files are checked (default 10)",
    )


def _webhook(args: argparse.Namespace) -> int:
    from vgpu import config
    from vgpu.daemon import logs, webhook

    # The node's config file gives the domain, memory unit and logging: the
    # webhook judges requests exactly as the node does.
    flags = {"resource_domain": args.resource_domain}
    node = config.load(flags, config_file=args.config)
    settings = webhook.WebhookSettings(
        listen=args.listen,
        kubeconfig=args.kubeconfig,
        cert_dir=args.cert_dir,
        tls_san=tuple(args.tls_san),
        secret=args.secret,
        service=args.service,
        mutating_config=args.mutating_config,
        validating_config=args.validating_config,
        scheduler_name=args.scheduler_name,
        resource_domain=node.resource_domain,
        memory_unit_mib=node.memory_unit_mib,
        cert_validity_s=args.cert_validity_s,
        cert_check_interval_s=args.cert_check_interval_s,
        log_format=node.log_format,
        log_level=node.log_level,
    )
    logs.configure(settings.log_format, settings.log_level)
    return _exit(webhook.run(settings))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
