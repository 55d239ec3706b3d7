# A glued SilentSwarm model behind OpenAI-style completions (/v1/completions, /v1/models,
# /metrics with the token; /health without). The model is `swarm glue`'s output, at the same
# path on every client that may run it (-var model_dir=...; -var node_class=... keeps the job on
# those clients). The API token comes from the variable nomad/jobs/swarm-serve:
#   nomad var put nomad/jobs/swarm-serve token=$(openssl rand -hex 24)
# and reaches the server in its environment (SWARM_SERVE_TOKEN), never on its command line.
# The task waits until that variable exists: the server never starts without a token.
# `-var gpus=N` asks for N NVIDIA GPUs (the nvidia device plugin), as the fellow job does.
#
# Driver: `exec` (chroot, as the user "silentswarm"); the package and the model come in
# read-only through the host volumes "silentswarm" and "swarm-models" (mounted at
# /srv/swarm-models: put model_dir under it). The nvidia device plugin gives a task no device
# nodes, so with gpus > 0 the task runs under raw_exec (still as "silentswarm"), reading the
# host's paths; -var driver=... overrides either choice.

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "model_dir" {
  type    = string
  default = "/srv/swarm-models/model"
}

variable "serve_port" {
  type    = number
  default = 8000
}

variable "slots" {
  type    = number
  default = 8
}

variable "gpus" {
  type    = number
  default = 0
}

# "" picks exec without GPUs, raw_exec with them.
variable "driver" {
  type    = string
  default = ""
}

variable "user" {
  type    = string
  default = "silentswarm"
}

locals {
  driver = var.driver != "" ? var.driver : (var.gpus > 0 ? "raw_exec" : "exec")
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

    update {
      max_parallel      = 1
      health_check      = "checks"
      min_healthy_time  = "10s"
      healthy_deadline  = "10m"
      progress_deadline = "15m"
      auto_revert       = true
    }

    restart {
      attempts = 10
      interval = "30m"
      delay    = "10s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = true
    }

    # client { host_volume "silentswarm" { path = "/opt/silentswarm" read_only = true } }
    volume "package" {
      type      = "host"
      source    = "silentswarm"
      read_only = true
    }

    # client { host_volume "swarm-models" { path = "/srv/swarm-models" read_only = true } }
    volume "models" {
      type      = "host"
      source    = "swarm-models"
      read_only = true
    }

    task "serve" {
      driver = local.driver
      user   = var.user

      # Mounted where the host has them: the same paths under exec and raw_exec.
      dynamic "volume_mount" {
        for_each = local.driver == "raw_exec" ? [] : ["package"]
        content {
          volume      = "package"
          destination = "/opt/silentswarm"
          read_only   = true
        }
      }

      dynamic "volume_mount" {
        for_each = local.driver == "raw_exec" ? [] : ["models"]
        content {
          volume      = "models"
          destination = "/srv/swarm-models"
          read_only   = true
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

          # Three failures in a row restart the task; the grace covers loading the model.
          check_restart {
            limit = 3
            grace = "5m"
          }
        }
      }

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
        HOME                 = "${NOMAD_TASK_DIR}"
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

      resources {
        cpu    = 2000
        memory = var.gpus > 0 ? 8192 : 4096

        dynamic "device" {
          for_each = var.gpus > 0 ? ["nvidia/gpu"] : []
          labels   = ["nvidia/gpu"]
          content {
            count = var.gpus
          }
        }
      }
    }
  }
}
