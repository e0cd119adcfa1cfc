//! `nodectl config validate`.

use std::path::Path;

use anyhow::Result;
use serde_json::json;

use crate::config::RunConfig;

pub(super) fn validate(file: &Path, json: bool) -> Result<()> {
    let config = match RunConfig::load(file) {
        Ok(config) => config,
        Err(err) if json => {
            println!(
                "{}",
                json!({"file": file, "valid": false, "error": format!("{err:#}")})
            );
            return Err(err);
        }
        Err(err) => return Err(err),
    };
    let network = config.model.network()?;
    let params = network.layout().len();
    let spec = config.train_spec();
    if json {
        println!(
            "{}",
            json!({
                "file": file,
                "valid": true,
                "name": config.name(),
                "model": config.model,
                "params": params,
                "fingerprint": network.fingerprint(),
                "config_hash": spec.config_hash(),
                "optimizer": config.optimizer,
                "epochs": config.training.epochs,
                "batch_size": config.training.batch_size,
                "data_dir": config.data.dir,
                "data_dir_exists": config.data.dir.is_dir(),
            })
        );
    } else {
        println!(
            "{}: valid ({:?} with {} parameters, {:?} at lr {}, {} epochs of batch {})",
            file.display(),
            config.model.kind,
            params,
            config.optimizer.kind,
            config.optimizer.lr,
            config.training.epochs,
            config.training.batch_size,
        );
        if !config.data.dir.is_dir() {
            let install = match network.context() {
                Some(_) => "`data/fetch-shakespeare.sh` (or any directory of `.txt` files)",
                None => "`apt-get install dataset-fashion-mnist`",
            };
            println!(
                "note: data.dir `{}` does not exist here; install it with {install} or pass \
                 `--data DIR` when training",
                config.data.dir.display()
            );
        }
    }
    Ok(())
}
