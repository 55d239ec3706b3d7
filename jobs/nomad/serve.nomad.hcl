# A glued SilentSwarm model behind OpenAI-style completions (/v1/completions, /v1/models,
# /metrics with the token; /health without). The model is `swarm glue`'s output, at the same
# path on every client that may run it (-var model_dir=...; -var node_class=... keeps the job on
# those clients). The API token comes from the variable nomad/jobs/swarm-serve:
#   nomad var put nomad/jobs/swarm-serve token=$(openssl rand -hex 24)
# and reaches the server in its environment (SWARM_SERVE_TOKEN), never on its command line.
# The task waits until that variable exists: the server never starts without a token.
# `-var gpu=true` asks for an NVIDIA GPU (the nvidia device plugin), as the fellow job does.

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "model_dir" {
  type    = string
  default = "/var/lib/silentswarm/serve/model"
}

variable "serve_port" {
  type    = number
  default = 8000
}

variable "slots" {
  type    = number
  default = 8
}

variable "gpu" {
  type    = bool
  default = false
}

variable "node_class" {
  type    = string
  default = ""
}

job "swarm-serve" {
  datacenters = var.datacenters
  type        = "service"

  group "serve" {
    count = 1

    dynamic "constraint" {
      for_each = var.node_class == "" ? [] : [var.node_class]
      content {
        attribute = "${node.class}"
        value     = constraint.value
      }
    }

    network {
      port "http" {
        static = var.serve_port
      }
    }

    service {
      name     = "swarm-serve"
      port     = "http"
      provider = "nomad"
      tags     = ["openai", "completions"]

      # 200 once the model is loaded and traced (the port opens only then); no token needed.
      # /metrics (Prometheus) wants the bearer token: scrape it with its own job.
      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "2s"
      }
    }

    restart {
      attempts = 10
      interval = "30m"
      delay    = "10s"
      mode     = "delay"
    }

    task "serve" {
      driver = "raw_exec"

      config {
        command = "/opt/silentswarm/bin/python"
        args = [
          "-m", "silentswarm.agent.serve",
          "--model-dir", var.model_dir,
          "--host", "0.0.0.0",
          "--port", "${NOMAD_PORT_http}",
          "--slots", "${var.slots}",
        ]
      }

      # SIGTERM: the server stops taking requests and lets running ones finish (up to 5 s).
      kill_timeout = "20s"

      env {
        TF_CPP_MIN_LOG_LEVEL = "2"
      }

      template {
        destination = "secrets/serve.env"
        env         = true
        change_mode = "restart"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-serve" }}
        SWARM_SERVE_TOKEN={{ .token }}
        {{- end }}
        EOT
      }

      dynamic "resources" {
        for_each = var.gpu ? [] : [1]
        content {
          cpu    = 2000
          memory = 4096
        }
      }

      dynamic "resources" {
        for_each = var.gpu ? [1] : []
        content {
          cpu    = 2000
          memory = 8192

          device "nvidia/gpu" {
            count = 1
          }
        }
      }
    }
  }
}
