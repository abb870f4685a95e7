"""A small HTTP server that plays the Kubernetes API for the MPIJob and TrainJob tests (no cluster can run on
this machine). It stores the MPIJob or TrainJob it is sent (and a TrainJob's TrainingRuntime), answers status
reads, lists the launcher pod and serves its log; it also serves the Secrets a test puts in `secrets` (the
credentials check).
What an operator would do is scripted: the job's conditions advance one step per status read, and the
launcher's log grows a few characters per read. `on_create` lets a test act as the operator's pods (run the
job's command) when a job is created."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def condition(kind: str, reason: str = "", message: str = "") -> dict:
    return {"type": kind, "status": "True", "reason": reason or f"MPIJob{kind}", "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


CREATED = [condition("Created")]
RUNNING = CREATED + [condition("Running")]
SUCCEEDED = CREATED + [{**condition("Running"), "status": "False"}, condition("Succeeded")]
FAILED = CREATED + [{**condition("Running"), "status": "False"},
                    condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]
# Kubeflow Trainer v2's TrainJob conditions
TJ_CREATED = [condition("Created", "JobsCreationSucceeded")]
TJ_COMPLETE = TJ_CREATED + [condition("Complete", "JobSetCompleted", "jobset completed successfully")]
TJ_FAILED = TJ_CREATED + [condition("Failed", "FailedJobs", "jobset failed")]
LOG_LINES = [f"[1,0]<stdout>:Epoch {i}/12 - loss: {1.0 / i:.4f} - mAP: {0.05 * i:.3f}" for i in range(1, 13)]


class PlayedKubernetes:
    """What the played API server knows and has seen. Conditions: one list per status read (the last repeats);
    the launcher log grows `chunk` characters per status read and is whole once the job has finished."""

    def __init__(self, script: list[list[dict]], log: str, chunk: int = 40):
        self.script, self.log, self.chunk = script, log, chunk
        self.jobs: dict[str, dict] = {}
        self.runtimes: dict[str, dict] = {}  # TrainingRuntimes by name
        self.deleted_runtimes: list[str] = []
        self.created: list[dict] = []
        self.create_queries: list[str] = []  # the query string of each create (fieldValidation=Strict)
        self.deleted: list[tuple[str, str]] = []  # (name, propagationPolicy)
        self.reads = 0
        self.create_error: tuple[int, str] | None = None  # (HTTP status, body) to answer the POST with
        self.log_error: tuple[int, str] | None = None  # ... and the log reads
        self.selectors: list[str] = []
        self.on_create = None  # callable(job body), run in a thread when a job is created: the job's pods
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, name) -> data (base64 values)
        self.secret_error: tuple[int, str] | None = None  # (HTTP status, body) to answer Secret reads with
        self.lock = threading.Lock()

    def conditions(self) -> list[dict]:
        return self.script[min(self.reads, len(self.script)) - 1] if self.reads else []

    def finished(self) -> bool:
        return any(c["type"] in ("Succeeded", "Complete", "Failed") and c["status"] == "True"
                   for c in self.conditions())

    def launcher_template(self, job: dict) -> tuple[dict, str]:
        """(the launcher's pod template, its container's name) of an MPIJob or of a TrainJob's runtime."""
        if job["kind"] == "MPIJob":
            template = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]
        else:
            runtime = self.runtimes[job["spec"]["runtimeRef"]["name"]]
            [launcher] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "launcher"]
            template = launcher["template"]["spec"]["template"]
        return template, template["spec"]["containers"][0]["name"]

    def log_so_far(self) -> str:
        return self.log if self.finished() else self.log[:self.reads * self.chunk]


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> str:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                       "reason": reason, "details": details or {}, "code": code})


def make_handler(kube: PlayedKubernetes):
    jobs_path = re.compile(r"^/apis/(?:kubeflow\.org/(?:v1|v2beta1)/namespaces/([^/]+)/(mpijobs)|trainer\.kubeflow\.org"
                           r"/v1alpha1/namespaces/([^/]+)/(trainjobs|trainingruntimes))(?:/([^/]+))?$")

    def parts(match) -> tuple[str, str | None]:
        """(plural, name) of a jobs_path match."""
        return match.group(2) or match.group(4), match.group(5)
    pods_path = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)/log)?$")
    secret_path = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets/([^/]+)$")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output clean
            pass

        def reply(self, code: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length))
            match = jobs_path.match(urlsplit(self.path).path)
            if not match or parts(match)[1]:
                return self.reply(404, "404 page not found", "text/plain")
            plural = parts(match)[0]
            store = kube.runtimes if plural == "trainingruntimes" else kube.jobs
            with kube.lock:
                if kube.create_error:
                    return self.reply(*kube.create_error)
                name = body["metadata"]["name"]
                if name in store:
                    return self.reply(409, status_body(409, "AlreadyExists", f'{plural} "{name}" already exists'))
                kube.created.append(copy.deepcopy(body))
                kube.create_queries.append(urlsplit(self.path).query)
                store[name] = body
            if kube.on_create and store is kube.jobs:
                threading.Thread(target=kube.on_create, args=(copy.deepcopy(body),), daemon=True).start()
            self.reply(201, json.dumps(body))

        def do_GET(self):
            url = urlsplit(self.path)
            if match := secret_path.match(url.path):
                with kube.lock:
                    if kube.secret_error:
                        return self.reply(*kube.secret_error)
                    data = kube.secrets.get((match.group(1), match.group(2)))
                if data is None:
                    return self.reply(404, status_body(404, "NotFound", f'secrets "{match.group(2)}" not found'))
                return self.reply(200, json.dumps({"kind": "Secret", "apiVersion": "v1", "type": "Opaque", "data": data,
                                                   "metadata": {"name": match.group(2), "namespace": match.group(1)}}))
            if match := jobs_path.match(url.path):
                plural, name = parts(match)
                with kube.lock:
                    if plural == "trainingruntimes":
                        runtime = kube.runtimes.get(name)
                        return self.reply(*((200, json.dumps(runtime)) if runtime else
                                            (404, status_body(404, "NotFound", "not found"))))
                    job = kube.jobs.get(name)
                    if job is None:
                        return self.reply(404, status_body(404, "NotFound", "not found"))
                    kube.reads += 1
                    conditions = kube.conditions()
                    if job["kind"] == "MPIJob":
                        running = not kube.finished() and any(c["type"] == "Running" for c in conditions)
                        workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
                        replicas = {"Launcher": {"active": 1}, "Worker": {"active": workers}} if running else {}
                        status = {"conditions": conditions, "replicaStatuses": replicas}
                    else:  # a TrainJob: one entry per replicated job of its JobSet
                        running = not kube.finished() and bool(conditions)
                        status = {"conditions": conditions, "jobsStatus": [
                            {"name": "launcher", "active": int(running), "ready": 0, "succeeded": 0, "failed": 0,
                             "suspended": 0},
                            {"name": "node", "active": int(running), "ready": int(running), "succeeded": 0,
                             "failed": 0, "suspended": 0}]} if running else {"conditions": conditions}
                    return self.reply(200, json.dumps({**job, "status": status}))
            if match := pods_path.match(url.path):
                with kube.lock:
                    if match.group(2):  # the log
                        return self.reply(*(kube.log_error or (200, kube.log_so_far(), "text/plain")))
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    kube.selectors.append(selector)
                    wanted = dict(pair.split("=", 1) for pair in selector.split(",") if pair)
                    pods = []
                    for name, job in kube.jobs.items():
                        template, container = kube.launcher_template(job)
                        # what the operators put on the pod: the template's labels plus their own
                        labels = {**template["metadata"]["labels"], "training.kubeflow.org/job-name": name,
                                  "training.kubeflow.org/job-role": "launcher"}
                        if wanted.items() <= labels.items():
                            pods.append({"metadata": {"name": f"{name}-launcher-x7k2p", "labels": labels,
                                                      "namespace": match.group(1),
                                                      "creationTimestamp": "2026-01-01T00:00:00Z"},
                                         "status": {"phase": "Running", "containerStatuses": [
                                             {"name": container, "restartCount": 0, "ready": True, "image": "x",
                                              "imageID": "", "started": True}]}})
                    return self.reply(200, json.dumps({"kind": "PodList", "apiVersion": "v1", "items": pods,
                                                       "metadata": {}}))
            self.reply(404, "404 page not found", "text/plain")

        def do_DELETE(self):
            url = urlsplit(self.path)
            match = jobs_path.match(url.path)
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            plural, name = parts(match) if match else (None, None)
            store = kube.runtimes if plural == "trainingruntimes" else kube.jobs
            with kube.lock:
                if not match or store.pop(name, None) is None:
                    return self.reply(404, status_body(404, "NotFound", "not found"))
                policy = parse_qs(url.query).get("propagationPolicy", [""])[0]
                if store is kube.runtimes:
                    kube.deleted_runtimes.append(name)
                else:
                    kube.deleted.append((name, policy))
            self.reply(200, status_body(200, "", "deleted").replace('"Failure"', '"Success"'))

    return Handler


@contextlib.contextmanager
def serve(kube: PlayedKubernetes):
    """The played API on a free loopback port, for the length of the block; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(kube))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
