# The SilentSwarm leader: REST API, Ops UI (/ops/join-v2), Prometheus metrics, job orchestration.
# It finds NATS through Nomad's service discovery; its state lives in JetStream. Until the
# swarm-nats service is registered it gets an address that cannot resolve (and waits), never
# none (without one it would start a private nats-server of its own).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "leader_port" {
  type    = number
  default = 8080
}

job "swarm-leader" {
  datacenters = var.datacenters
  type        = "service"

  group "leader" {
    count = 1

    network {
      port "http" {
        static = var.leader_port
      }
    }

    service {
      name     = "swarm-leader"
      port     = "http"
      provider = "nomad"
      tags     = ["ops-ui", "prometheus"]

      # Nomad's native services carry no meta to Prometheus: find the leader by the
      # "prometheus" tag (nomad_sd_configs) and scrape metrics_path /api/v1/metrics.

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
      delay    = "5s"
      mode     = "delay"
    }

    task "leader" {
      driver = "raw_exec"

      config {
        command = "/opt/silentswarm/bin/swarm-leader"
      }

      env {
        SWARM_LEADER_HOST    = "0.0.0.0"
        SWARM_LEADER_PORT    = "${NOMAD_PORT_http}"
        SWARM_STATE_DIR      = "${NOMAD_ALLOC_DIR}/data"
        SWARM_LOG_LEVEL      = "INFO"
        SWARM_NATS_AUTH_DIR  = "${NOMAD_SECRETS_DIR}/nats-auth"
        SWARM_NATS_CREDS     = "${NOMAD_SECRETS_DIR}/nats-auth/leader.creds"
      }

      # The swarm's NATS authority (its keys mint each fellow's user) and the leader's own
      # user, from the variable nomad/jobs/swarm-leader (see docs/deploy/nomad.md):
      #   operator_nk, account_nk, system_nk, leader_creds, and enroll_token (the secret
      #   fleet fellows present to get their user). The task waits until it exists.
      template {
        destination = "secrets/nats-auth/operator.nk"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .operator_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/account.nk"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .account_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/system.nk"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .system_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/leader.creds"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .leader_creds }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/enroll.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}
        SWARM_ENROLL_TOKEN={{ .enroll_token }}
        {{- end }}
        EOT
      }

      template {
        destination = "local/nats.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{- range nomadService "swarm-nats" }}
        SWARM_NATS_URL=nats://{{ .Address }}:{{ .Port }}
        {{- else }}
        SWARM_NATS_URL=nats://swarm-nats-not-registered.invalid:4222
        {{- end }}
        EOT
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
