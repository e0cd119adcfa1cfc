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
    let Some(model) = &config.model else {
        // A run whose peers bring their own model (PyTorch): nothing of Murmur's to describe.
        if json {
            println!(
                "{}",
                json!({
                    "file": file,
                    "valid": true,
                    "name": config.name(),
                    "model": null,
                    "reads_text": config.reads_text(),
                    "epochs": config.training.epochs,
                    "batch_size": config.training.batch_size,
                    "data_dir": config.data.dir,
                    "data_dir_exists": config.data.dir.is_dir(),
                })
            );
        } else {
            println!(
                "{}: valid (a run whose peers bring their own model, {} epochs of batch {}; \
                 start them from Python with `murmur.join`, docs/pytorch.md)",
                file.display(),
                config.training.epochs,
                config.training.batch_size,
            );
        }
        return Ok(());
    };
    let network = model.expand()?;
    let params = network.layout().len();
    let spec = config.train_spec().ok();
    if json {
        println!(
            "{}",
            json!({
                "file": file,
                "valid": true,
                "name": config.name(),
                "model": model,
                "reads_text": network.context().is_some(),
                "params": params,
                "fingerprint": network.fingerprint(),
                "config_hash": spec.map(|spec| spec.config_hash()),
                "optimizer": config.optimizer,
                "epochs": config.training.epochs,
                "batch_size": config.training.batch_size,
                "data_dir": config.data.dir,
                "data_dir_exists": config.data.dir.is_dir(),
            })
        );
    } else {
        let optimizer = match &config.optimizer {
            Some(o) => format!("{:?} at lr {}", o.kind, o.lr),
            None => "no optimizer of Murmur's (PyTorch peers bring theirs)".to_owned(),
        };
        println!(
            "{}: valid ({:?} with {} parameters, {optimizer}, {} epochs of batch {})",
            file.display(),
            model.kind,
            params,
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
