# featurehouse on Apache Airflow: the official image, plus this package, its DAGs and its config.
# Built and run by docker-compose.yml (`make up`).
FROM apache/airflow:3.3.2-python3.11

USER root
# Mount points of the warehouse, landing-area and inbox volumes, and of the simple auth manager's
# password file: made here so that a fresh named volume belongs to the airflow user, and
# group 0 may write it (compose runs as AIRFLOW_UID with group 0, as the official image allows).
RUN mkdir -p /opt/featurehouse /data/warehouse/landing /data/inbox /opt/airflow/auth \
 && chown -R airflow:0 /opt/featurehouse /data /opt/airflow/auth \
 && chmod -R g+rwX /opt/featurehouse /data /opt/airflow/auth
USER airflow

WORKDIR /opt/featurehouse
COPY --chown=airflow:0 pyproject.toml README.md ./
COPY --chown=airflow:0 pipeline ./pipeline
# Editable, so that the package's non-Python files (templates) are used where they are;
# apache-airflow is pinned to the image's own version so that pip never swaps it.
RUN pip install --no-cache-dir -e ".[airflow]" "apache-airflow==${AIRFLOW_VERSION}"
COPY --chown=airflow:0 schemas ./schemas
COPY --chown=airflow:0 dags ./dags
COPY --chown=airflow:0 featurehouse.toml ./featurehouse.toml
COPY --chown=airflow:0 deploy ./deploy
WORKDIR /opt/airflow
